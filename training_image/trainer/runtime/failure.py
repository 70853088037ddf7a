"""Tell SageMaker (and so the run supervisor, the notification and `trainstack runs`) why a job's process
failed: one classified line in the job's failure file, for every uncaught exception.

The classes and the line: trainstack.protocol.failures (deterministic: recipe, code, missing resource,
not retried; possibly transient: retried within the run's budget). The files: a training job's
/opt/ml/output/failure (its FailureReason), a processing job's /opt/ml/output/message (its ExitMessage),
under $TRAINSTACK_OPT_ML on the local emulator (trainstack.protocol.container). A file is written only
where its folder exists (a run outside a job writes nothing). Every rank writes its host's file: a
deterministic line replaces what is there, a transient one is written only where nothing is yet
(trainstack.protocol.exit_codes.write_failure_file), so whichever host's file SageMaker keeps says
"do not retry" when any rank knew it.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from trainstack.protocol import exit_codes, failures
from trainstack.protocol.container import opt_ml

FAILURE_FILE_ENV = "TRAINSTACK_FAILURE_FILE"  # tests, and the local tuning run: where the line goes


def failure_file(contract_path: str = exit_codes.FAILURE_FILE) -> Path | None:
    """The job's failure file (`contract_path`, an /opt/ml path), where it can be written."""
    configured = os.environ.get(FAILURE_FILE_ENV)
    path = Path(configured) if configured else opt_ml(contract_path.removeprefix("/opt/ml/"))
    return path if path.parent.is_dir() else None


def report_failure(exit_code: int, message: str, contract_path: str = exit_codes.FAILURE_FILE) -> int:
    """Print the one-line error (each host's first rank: one line per host's log) and write the failure
    line from every rank; `exit_code`, for the process to exit with."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"error: {' '.join(message.split())}", file=sys.stderr, flush=True)
    path = failure_file(contract_path)
    if path is not None:
        exit_codes.write_failure_file(path, exit_code, message)
    return exit_code


def report_uncaught(exc: BaseException, contract_path: str = exit_codes.FAILURE_FILE) -> int:
    """An exception nothing else handled: its traceback to the log (for whoever debugs it), its class,
    cause and what to change to the failure file; the exit code of its class."""
    traceback.print_exception(exc, file=sys.stderr)
    found = failures.classify(exc)
    return report_failure(found.exit_code, found.message, contract_path)


ARGUMENTS_REFUSED = (
    "the entry point's arguments were refused (exit {code}; its usage line is in the job's log): the "
    "request's container arguments or hyperparameters are wrong; not retried"
)


def run_reporting(main: Callable[[], int], contract_path: str = exit_codes.FAILURE_FILE) -> int:
    """`main()`, with any exception it lets escape reported. argparse's refusal (SystemExit, non-zero) is
    a line too, then exits as it would; Ctrl-C passes through."""
    try:
        return main()
    except SystemExit as exc:
        if exc.code not in (0, None):
            code = exc.code if isinstance(exc.code, int) else exit_codes.RECIPE_OR_ENVIRONMENT
            path = failure_file(contract_path)
            if path is not None:
                exit_codes.write_failure_file(
                    path, exit_codes.RECIPE_OR_ENVIRONMENT, ARGUMENTS_REFUSED.format(code=code)
                )
        raise
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # every failure says why: nothing leaves a job without its line
        return report_uncaught(exc, contract_path)
