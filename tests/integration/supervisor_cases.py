"""The table of ways a job of a run can end, with the decision each must get. Driven through the pure
function (test_supervisor_decisions.py) and the state machine in the emulator
(test_supervisor_emulator.py); both must agree with `expected`."""

from __future__ import annotations

from dataclasses import dataclass

from trainstack.aws.supervisor import MAX_CONSECUTIVE_CRASHES
from trainstack.protocol.exit_codes import failure_line


@dataclass(frozen=True)
class Case:
    id: str
    status: str
    secondary: str
    reason: str | None = None
    stop_requested: bool = False
    at_job_limit: bool = False  # the job is the last the run may start before a person resumes it
    stale: bool = False  # the run's newest job is another one (a repeated or late event)
    run_state: str = "running"
    crashes: int = 0  # jobs in a row before this one that ended by the Crashed rule
    stalled: bool = False  # the record names this job as the one the supervisor stopped as stalled
    capacity_wait: int = 0  # minutes of the previous capacity wait (0: the previous job did not lack it)
    capacity_minutes: int = 0  # minutes waited for capacity so far
    capacity_budget: int = 72 * 60
    last_index: bool = False  # the job has the last index a run name has room for
    final_step: int | None = None  # the train:step the job reported in FinalMetricDataList (None: none)
    step_before: int = 0  # the step the previous job reported (the record's `step`)
    saved_step: int | None = None  # the train:saved_step it reported: its newest checkpoint (None: none)
    saved_before: int = 0  # the newest checkpoint step the run's jobs reported (the record's `saved_step`)
    crashes_after: int | None = None  # expected crashes in a row recorded with the next job
    outcome: str = ""  # expected trainstack.aws.supervisor.Outcome value
    rule: str = ""  # expected rule id
    wait_minutes: int = 0  # expected capacity wait before the next job


STEPS = 24000  # training.steps of 1b-bf16, the recipe of every case's run (supervisor_cloud.RECIPE)
FATAL = "AlgorithmError: " + failure_line(3, "loss became nan at step 1200 (lr too high?)")
CAPACITY = (
    "CapacityError: Unable to provision requested ML compute capacity. Please retry using a different "
    "ML instance type."
)
# Trainer failure lines (protocol.exit_codes.failure_line) that quote SageMaker's error names inside:
# botocore's text for a failed S3 read, and a capacity error the trainer's own code reported.
QUOTES_INTERNAL = "AlgorithmError: " + failure_line(
    1,
    "botocore.exceptions.ClientError: An error occurred (InternalServerError) when calling the GetObject "
    "operation: We encountered an internal error. Please try again.",
)
QUOTES_CAPACITY = "AlgorithmError: " + failure_line(
    1, "RuntimeError: CapacityError: data loader pool exhausted"
)
CODE_BUG = "AlgorithmError: " + failure_line(
    6,
    "deterministic code: TypeError: 'NoneType' object is not subscriptable (trainer/train.py:428 in "
    "_forward_backward); not retried: fix it, build the image, then resume RUN --set image.uri=...",
)
MISSING_BUCKET = "AlgorithmError: " + failure_line(
    7,
    "deterministic missing resource: S3Exception: Service error: The bucket does not exist (trainer/"
    "storage.py:252 in read); not retried: create it or grant the job's role access to it",
)
PEER_LOST = "AlgorithmError: " + failure_line(
    1, "possibly transient: DistNetworkError: Connection reset by peer; retried by the run's next job"
)
CASES = [
    Case("max-runtime", "Stopped", "MaxRuntimeExceeded", outcome="next_job", rule="MaxRuntime"),
    Case("spot-interrupted", "Stopped", "Interrupted", outcome="next_job", rule="SpotInterrupted"),
    Case("spot-wait", "Failed", "MaxWaitTimeExceeded", "spot capacity", outcome="next_job", rule="SpotWait"),
    Case("completed", "Completed", "Completed", final_step=STEPS, outcome="completed", rule="Completed"),
    Case(  # a plan's capacity block ends: the trainer saved at 1234 and exited 0 (trainer.runtime.capacity)
        "capacity-block-end",
        "Completed",
        "Completed",
        final_step=1234,
        step_before=800,
        saved_step=1234,
        saved_before=800,
        crashes=MAX_CONSECUTIVE_CRASHES - 1,
        outcome="next_job",
        rule="CapacityBlockEnd",
        crashes_after=0,  # it saved past the run's newest checkpoint
    ),
    Case(  # a job resumed at its last step logs none ("nothing to do"): the record's step decides
        "completed-nothing-left",
        "Completed",
        "Completed",
        step_before=STEPS,
        outcome="completed",
        rule="Completed",
    ),
    Case(  # the block ended before the first logged step: not done, and no progress: it counts
        "capacity-block-end-before-a-step",
        "Completed",
        "Completed",
        step_before=800,
        saved_before=800,
        crashes=1,
        outcome="next_job",
        rule="CapacityBlockEnd",
        crashes_after=2,
    ),
    Case(  # issue 40: after a block's deadline every job exits 0 at step 0; the third in a row ends it
        "capacity-block-end-without-progress-again",
        "Completed",
        "Completed",
        final_step=800,
        step_before=800,
        saved_step=800,  # its own save of the step it resumed from is no progress
        saved_before=800,
        crashes=MAX_CONSECUTIVE_CRASHES - 1,
        outcome="failed",
        rule="CrashLoop",
    ),
    Case(  # a stop that raced a block's end stops the run (resumable), not a next job
        "stop-at-capacity-block-end",
        "Completed",
        "Completed",
        final_step=1234,
        stop_requested=True,
        outcome="stopped",
        rule="StopRequested",
    ),
    Case(
        "stop-requested", "Stopped", "Stopped", stop_requested=True, outcome="stopped", rule="StopRequested"
    ),
    Case(
        "stop-raced-max-runtime",
        "Stopped",
        "MaxRuntimeExceeded",
        stop_requested=True,
        outcome="stopped",
        rule="StopRequested",
    ),
    Case(
        "stop-but-completed",
        "Completed",
        "Completed",
        final_step=STEPS,
        stop_requested=True,
        outcome="completed",
        rule="Completed",
    ),
    Case("stopped-elsewhere", "Stopped", "Stopped", outcome="stopped", rule="StoppedElsewhere"),
    Case("fatal-nan", "Failed", "Failed", FATAL, outcome="failed", rule="Fatal"),
    # Every uncaught exception's line (trainstack.protocol.failures): deterministic ones end the run on
    # their first job (issue 40: a missing bucket or a bug was a crash, three jobs), transient ones crash.
    Case("fatal-code-bug", "Failed", "Failed", CODE_BUG, outcome="failed", rule="Fatal"),
    Case("fatal-missing-resource", "Failed", "Failed", MISSING_BUCKET, outcome="failed", rule="Fatal"),
    Case("transient-peer-lost", "Failed", "Failed", PEER_LOST, outcome="next_job", rule="Crashed"),
    Case(
        "client-error",
        "Failed",
        "Failed",
        "ClientError: Access denied for repository: trainstack-images",
        outcome="failed",
        rule="ClientError",
    ),
    Case("capacity", "Failed", "Failed", CAPACITY, outcome="next_job", rule="Capacity", wait_minutes=15),
    Case(  # no instance ran: a capacity error never resets the crash count
        "capacity-keeps-the-crash-count",
        "Failed",
        "Failed",
        CAPACITY,
        crashes=MAX_CONSECUTIVE_CRASHES - 1,
        outcome="next_job",
        rule="Capacity",
        wait_minutes=15,
        crashes_after=MAX_CONSECUTIVE_CRASHES - 1,
    ),
    Case(  # the trainer's own line quotes SageMaker's error names: a crash, not a retry
        "trainer-quotes-internal-server-error",
        "Failed",
        "Failed",
        QUOTES_INTERNAL,
        crashes=MAX_CONSECUTIVE_CRASHES - 1,
        outcome="failed",
        rule="CrashLoop",
    ),
    Case(
        "trainer-quotes-capacity-error",
        "Failed",
        "Failed",
        QUOTES_CAPACITY,
        outcome="next_job",
        rule="Crashed",
        crashes_after=1,
    ),
    Case(  # a crash after a checkpoint past the run's newest: a new count of one
        "crashed-after-progress",
        "Failed",
        "Failed",
        "AlgorithmError: trainstack exit=1: NCCL watchdog timeout on rank 17",
        final_step=1500,
        step_before=1000,
        saved_step=1500,
        saved_before=1000,
        crashes=MAX_CONSECUTIVE_CRASHES - 1,
        outcome="next_job",
        rule="Crashed",
        crashes_after=1,
    ),
    Case(  # trained past the previous job's step, then crashed before its save completed (saves finish
        # in the background): the next job starts where this one did, so the crashes are a loop
        "crashed-past-the-step-without-a-save",
        "Failed",
        "Failed",
        "AlgorithmError: trainstack exit=1: NCCL watchdog timeout on rank 17",
        final_step=1500,
        step_before=1000,
        saved_before=1000,
        crashes=MAX_CONSECUTIVE_CRASHES - 1,
        outcome="failed",
        rule="CrashLoop",
    ),
    Case(  # an internal error without progress counts like any end without progress
        "internal-error-without-progress",
        "Failed",
        "Failed",
        "InternalServerError: We encountered an internal error. Please try again.",
        final_step=1000,
        step_before=1000,
        saved_before=1000,
        crashes=MAX_CONSECUTIVE_CRASHES - 2,
        outcome="next_job",
        rule="InternalError",
        crashes_after=MAX_CONSECUTIVE_CRASHES - 1,
    ),
    Case(  # ... and the third in a row fails the run (20 before: compute.max_jobs)
        "internal-error-again-without-progress",
        "Failed",
        "Failed",
        "InternalServerError: We encountered an internal error. Please try again.",
        step_before=1000,
        saved_before=1000,
        crashes=MAX_CONSECUTIVE_CRASHES - 1,
        outcome="failed",
        rule="CrashLoop",
    ),
    Case(  # an internal error after a save past the run's newest: progress, a new count
        "internal-error-after-progress",
        "Failed",
        "Failed",
        "InternalServerError: We encountered an internal error. Please try again.",
        final_step=1500,
        step_before=1000,
        saved_step=1500,
        saved_before=1000,
        crashes=MAX_CONSECUTIVE_CRASHES - 1,
        outcome="next_job",
        rule="InternalError",
        crashes_after=0,
    ),
    Case(  # spot capacity taken back before the first save, the third time in a row
        "spot-interrupted-before-a-save-again",
        "Stopped",
        "Interrupted",
        final_step=0,
        crashes=MAX_CONSECUTIVE_CRASHES - 1,
        outcome="failed",
        rule="CrashLoop",
    ),
    Case(  # spot capacity that never came back in time, the third time in a row without progress
        "spot-wait-without-progress-again",
        "Failed",
        "MaxWaitTimeExceeded",
        "spot capacity",
        step_before=300,
        saved_before=300,
        crashes=MAX_CONSECUTIVE_CRASHES - 1,
        outcome="failed",
        rule="CrashLoop",
    ),
    Case(  # a max runtime too short for a save (restore, compile, no checkpoint interval reached)
        "max-runtime-before-a-save",
        "Stopped",
        "MaxRuntimeExceeded",
        final_step=40,
        step_before=0,
        crashes=MAX_CONSECUTIVE_CRASHES - 2,
        outcome="next_job",
        rule="MaxRuntime",
        crashes_after=MAX_CONSECUTIVE_CRASHES - 1,
    ),
    Case(
        "max-runtime-before-a-save-again",
        "Stopped",
        "MaxRuntimeExceeded",
        final_step=40,
        step_before=40,
        crashes=MAX_CONSECUTIVE_CRASHES - 1,
        outcome="failed",
        rule="CrashLoop",
    ),
    Case(  # the second shortage in a row waits longer, and takes no slot: at the job limit, still a job
        "capacity-again-at-job-limit",
        "Failed",
        "Failed",
        CAPACITY,
        capacity_wait=15,
        capacity_minutes=15,
        at_job_limit=True,
        outcome="next_job",
        rule="Capacity",
        wait_minutes=30,
    ),
    Case(
        "capacity-long-shortage",
        "Failed",
        "Failed",
        CAPACITY,
        capacity_wait=120,
        capacity_minutes=600,
        outcome="next_job",
        rule="Capacity",
        wait_minutes=120,
    ),
    Case(
        "capacity-budget-spent",
        "Failed",
        "Failed",
        CAPACITY,
        capacity_wait=120,
        capacity_minutes=72 * 60 - 60,
        outcome="failed",
        rule="CapacityBudget",
    ),
    Case(  # a stop that raced a job's own failure keeps the failure's reason (and the run resumable)
        "stop-but-fatal", "Failed", "Failed", FATAL, stop_requested=True, outcome="failed", rule="Fatal"
    ),
    Case(
        "stop-but-crashed",
        "Failed",
        "Failed",
        "AlgorithmError: x",
        stop_requested=True,
        outcome="stopped",
        rule="StopRequested",
    ),
    Case("stalled", "Stopped", "Stopped", stalled=True, outcome="next_job", rule="Stalled"),
    Case(
        "stalled-again-crash-loop",
        "Stopped",
        "Stopped",
        stalled=True,
        crashes=MAX_CONSECUTIVE_CRASHES - 1,
        outcome="failed",
        rule="CrashLoop",
    ),
    Case(
        "stalled-but-stop-requested",
        "Stopped",
        "Stopped",
        stalled=True,
        stop_requested=True,
        outcome="stopped",
        rule="StopRequested",
    ),
    Case(
        "no-job-names", "Stopped", "MaxRuntimeExceeded", last_index=True, outcome="failed", rule="NoJobNames"
    ),
    Case(
        "internal-error",
        "Failed",
        "Failed",
        "InternalServerError: We encountered an internal error. Please try again.",
        outcome="next_job",
        rule="InternalError",
    ),
    Case(
        "crashed",
        "Failed",
        "Failed",
        "AlgorithmError: trainstack exit=1: NCCL watchdog timeout on rank 17",
        outcome="next_job",
        rule="Crashed",
    ),
    Case(
        "crashed-again",
        "Failed",
        "Failed",
        "AlgorithmError: trainstack exit=1: NCCL watchdog timeout on rank 17",
        crashes=MAX_CONSECUTIVE_CRASHES - 2,
        outcome="next_job",
        rule="Crashed",
    ),
    Case(
        "crash-loop",
        "Failed",
        "Failed",
        "AlgorithmError: ExecuteUserScriptError: IndexError: index out of range",
        crashes=MAX_CONSECUTIVE_CRASHES - 1,
        outcome="failed",
        rule="CrashLoop",
    ),
    Case(
        "max-runtime-after-crashes",  # a job that trained to its limit: the crashes were not a loop
        "Stopped",
        "MaxRuntimeExceeded",
        final_step=9000,
        step_before=1000,
        saved_step=9000,
        saved_before=1000,
        crashes=MAX_CONSECUTIVE_CRASHES - 1,
        outcome="next_job",
        rule="MaxRuntime",
        crashes_after=0,
    ),
    Case(
        "job-limit",
        "Stopped",
        "MaxRuntimeExceeded",
        at_job_limit=True,
        outcome="failed",
        rule="JobLimit",
    ),
    Case("stale-event", "Stopped", "MaxRuntimeExceeded", stale=True, outcome="ignored", rule="Ignored"),
    Case("run-not-running", "Completed", "Completed", run_state="stopped", outcome="ignored", rule="Ignored"),
]
