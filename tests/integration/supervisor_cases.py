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
    outcome: str = ""  # expected trainstack.aws.supervisor.Outcome value
    rule: str = ""  # expected rule id
    wait_minutes: int = 0  # expected capacity wait before the next job


FATAL = "AlgorithmError: " + failure_line(3, "loss became nan at step 1200 (lr too high?)")
CAPACITY = (
    "CapacityError: Unable to provision requested ML compute capacity. Please retry using a different "
    "ML instance type."
)
CASES = [
    Case("max-runtime", "Stopped", "MaxRuntimeExceeded", outcome="next_job", rule="MaxRuntime"),
    Case("spot-interrupted", "Stopped", "Interrupted", outcome="next_job", rule="SpotInterrupted"),
    Case("spot-wait", "Failed", "MaxWaitTimeExceeded", "spot capacity", outcome="next_job", rule="SpotWait"),
    Case("completed", "Completed", "Completed", outcome="completed", rule="Completed"),
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
        stop_requested=True,
        outcome="completed",
        rule="Completed",
    ),
    Case("stopped-elsewhere", "Stopped", "Stopped", outcome="stopped", rule="StoppedElsewhere"),
    Case("fatal-nan", "Failed", "Failed", FATAL, outcome="failed", rule="Fatal"),
    Case(
        "client-error",
        "Failed",
        "Failed",
        "ClientError: Access denied for repository: trainstack-images",
        outcome="failed",
        rule="ClientError",
    ),
    Case("capacity", "Failed", "Failed", CAPACITY, outcome="next_job", rule="Capacity", wait_minutes=15),
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
        crashes=MAX_CONSECUTIVE_CRASHES - 1,
        outcome="next_job",
        rule="MaxRuntime",
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
