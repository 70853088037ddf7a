"""How a training job tells the launcher why it ended: exit codes and SageMaker's failure file.

The trainer exits with one of these codes, and before a non-zero exit writes one line to SageMaker's
failure file, which SageMaker copies into the job's `FailureReason`. The run supervisor
(trainstack.aws.supervisor) reads that reason: a line starting with FATAL_MARKER names a failure that
another job of the same run would repeat (a mistake in the recipe or the data, a diverged loss), so
the run ends there and a person is told; any other failure (a crashed node, a lost collective, a
capacity error) is worth the run's next job, which resumes from the newest complete checkpoint.

Every host writes it. SageMaker keeps one host's failure file as the job's FailureReason; if only
global rank 0's host wrote the fatal line, another host's reason (a crash, or nothing) could win and a
fatal failure would look like a crash: the run would start up to three more jobs (the Crashed rule)
that fail the same way. So every rank that ends with an error writes its host's file
(`write_failure_file`): a fatal line replaces whatever is there, any other line is written only where
nothing is yet, so a host's fatal line is never replaced by a crash another of its ranks saw.

No third-party imports: the training image imports this module.
"""

from __future__ import annotations

import os
from pathlib import Path

OK = 0  # finished, or stopped by SIGTERM after saving (or after logging which checkpoint resumes)
# Possibly transient (the final save failed, the network, a collective, a peer lost, an error nobody
# recognised): worth the run's next job (trainstack.protocol.failures).
TRANSIENT = 1
RECIPE_OR_ENVIRONMENT = 2  # a mistake in the recipe, the data or the job's environment
NON_FINITE = 3  # the loss or the gradient norm became NaN/inf
NETWORK = 4  # a multi-node job whose collectives would not run over EFA (the comms gate)
# The GPU ran out of memory. Fatal: the next job runs the same layout on the same GPUs and would run out
# the same way; the tuning run (trainstack.tuning) records such a candidate as `oom`, not as a crash.
OUT_OF_MEMORY = 5
# An uncaught error of the code itself (TypeError, ImportError, a torch.compile failure): the next job of
# the same image and recipe repeats it (trainstack.protocol.failures).
CODE = 6
# Something the job reads or writes is missing or refused (a bucket, a key, a file, access denied): the
# next job would find it missing too, until a person creates it or grants access.
MISSING_RESOURCE = 7
FATAL = frozenset({RECIPE_OR_ENVIRONMENT, NON_FINITE, NETWORK, OUT_OF_MEMORY, CODE, MISSING_RESOURCE})
OOM_MESSAGE = "out of GPU memory"  # how the trainer's failure line starts its message for OUT_OF_MEMORY

# SageMaker reads the reason a training job failed from this file; DescribeTrainingJob's FailureReason
# holds at most 1,024 characters (SageMaker API reference and botocore's service model: FailureReason,
# "Length Constraints: Maximum length of 1024"; tests/unit/test_failures.py pins it), so the line is cut
# there: the class and the cause come first. A processing job's is MESSAGE_FILE, its ExitMessage, also
# at most 1,024 (developer guide, "Save and Access Metadata Information About Your Processing Job").
FAILURE_FILE = "/opt/ml/output/failure"
MESSAGE_FILE = "/opt/ml/output/message"
FAILURE_REASON_MAX = 1024
FATAL_MARKER = "trainstack-fatal"


def failure_line(exit_code: int, message: str) -> str:
    """The failure file's content for `exit_code`: `trainstack-fatal exit=3: <message>` for a failure
    another job would repeat, `trainstack exit=N: <message>` otherwise; one line, within SageMaker's limit."""
    head = f"{FATAL_MARKER} exit={exit_code}" if exit_code in FATAL else f"trainstack exit={exit_code}"
    text = f"{head}: {' '.join(message.split())}"
    return text[:FAILURE_REASON_MAX]


def exit_code_of(failure_reason: str | None) -> int | None:
    """The exit code a `failure_line` names (`... exit=N: ...`), or None for another reason."""
    import re

    match = re.search(r"\bexit=(\d+):", failure_reason or "")
    return int(match.group(1)) if match else None


def is_fatal(failure_reason: str | None) -> bool:
    """Whether a job's FailureReason says its run must not start another job."""
    return bool(failure_reason) and FATAL_MARKER in failure_reason


def write_failure_file(path: Path, exit_code: int, message: str) -> bool:
    """Write the failure line for `exit_code` to `path` (SageMaker's failure file of this host), safely
    when several ranks of the host write at once; False when a line already there was kept."""
    text = failure_line(exit_code, message) + "\n"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    try:
        if exit_code in FATAL:
            os.replace(tmp, path)  # atomic: readers see the old line or this one, never a mix
            return True
        try:
            os.link(tmp, path)  # atomic create-if-absent: never replaces another rank's (fatal) line
            return True
        except FileExistsError:
            return False
    finally:
        tmp.unlink(missing_ok=True)
