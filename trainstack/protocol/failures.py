"""Why a job's process failed, in one line, and whether the next job would fail the same way.

Every uncaught exception of a job's entry point (`python -m trainer`, `trainer.export`,
`trainer.prepare`, `trainer.entrypoint`) is classified here and written to SageMaker's failure file
(trainstack.protocol.exit_codes.write_failure_file), which SageMaker copies into `FailureReason`:

- deterministic, the next job of the run would repeat it (it is not retried: the run fails at once and
  the line says what to change):
  - `recipe` (exit 2): a mistake in the recipe, the data or the job's environment that the trainer
    itself checked (trainstack.errors.TrainstackError: its message names the file and field);
  - `code` (exit 6): an error of the code itself (TypeError, AttributeError, ImportError, a torch.compile
    failure, ...): no other job of the same image and recipe gets past it;
  - `missing resource` (exit 7): something the job reads or writes does not exist or is refused (a
    bucket, a key, a file, access denied): a person creates it or grants access, then resumes;
- possibly transient (exit 1): the network, a collective, a peer that died, throttling, a service's
  internal error, or anything not recognised: the run's next job tries again, within the run's budget
  of ends without progress (trainstack.aws.supervisor.MAX_CONSECUTIVE_CRASHES).

Issue 40: only 4 error types wrote the file, so a missing checkpoint bucket, a compile failure or a real
bug ended "exit code 1 (no /opt/ml/output/failure)", was retried twice as a crash, and neither the
notification nor `trainstack runs` said why.

Classified by class names and the modules they come from, never by importing torch, botocore or
s3torchconnector (the training image imports this module; the CLI imports none of those eagerly). An
exception's cause chain is read too: a checkpoint error raised `from` a missing bucket is a missing
resource. No third-party imports.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

from trainstack.protocol import exit_codes

RECIPE = "recipe"
CODE = "code"
MISSING_RESOURCE = "missing resource"
TRANSIENT = "possibly transient"
EXIT_CODE = {
    RECIPE: exit_codes.RECIPE_OR_ENVIRONMENT,
    CODE: exit_codes.CODE,
    MISSING_RESOURCE: exit_codes.MISSING_RESOURCE,
    TRANSIENT: exit_codes.TRANSIENT,
}
# What a person changes, by class (the run's name is not known inside the job: `trainstack runs` and the
# notification name it).
ADVICE = {
    RECIPE: (
        "not retried: every job of the run trains its recorded recipe, so fix the recipe and launch a new "
        "run (resume --set changes only what may change mid-run)"
    ),
    CODE: (
        "not retried: the next job would run the same code; fix it (or the recipe setting that reaches "
        "it), build the image, then trainstack resume RUN --set image.uri=<fixed image>"
    ),
    MISSING_RESOURCE: (
        "not retried: create it or grant the job's role access to it, then trainstack resume RUN"
    ),
    TRANSIENT: "retried by the run's next job (up to 3 jobs in a row without progress)",
}
COMPILE_ADVICE = (
    "not retried: torch.compile cannot compile this model or step; trainstack resume RUN --set "
    "training.compile=false, or fix the code and resume --set image.uri=<fixed image>"
)
CAUSE_MAX = 480  # characters of the exception's own text: the line stays far within FAILURE_REASON_MAX

# Python's own errors of the program, not of the world: the same code and input raise them again.
CODE_ERRORS = frozenset(
    {
        "TypeError",
        "AttributeError",
        "NameError",
        "UnboundLocalError",
        "ImportError",
        "ModuleNotFoundError",
        "SyntaxError",
        "KeyError",
        "IndexError",
        "LookupError",
        "ValueError",
        "ZeroDivisionError",
        "ArithmeticError",
        "AssertionError",
        "NotImplementedError",
        "RecursionError",
    }
)
# Missing or refused things of the file system.
MISSING_FILE_ERRORS = frozenset(
    {"FileNotFoundError", "NotADirectoryError", "IsADirectoryError", "PermissionError"}
)
# The network, a peer, a collective, a timeout: another job on other instances may well get past them.
TRANSIENT_ERRORS = frozenset(
    {
        "ConnectionError",  # ConnectionResetError, ConnectionRefusedError, BrokenPipeError, ...
        "TimeoutError",
        "DistError",  # torch.distributed: DistBackendError (NCCL, gloo), DistNetworkError, DistStoreError
        "EndpointConnectionError",  # botocore
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ConnectionClosedError",
        "IncompleteReadError",
        "MemoryError",  # the host's memory: another job's instances, or less of it, may get past it
    }
)
# botocore ClientError codes (Error.Code) that name a missing or refused resource.
MISSING_CODES = frozenset(
    {
        "NoSuchBucket",
        "NoSuchKey",
        "NotFound",
        "404",
        "AccessDenied",
        "AccessDeniedException",
        "403",
        "Forbidden",
        "InvalidAccessKeyId",
        "AllAccessDisabled",
        "KMS.NotFoundException",
        "KMS.DisabledException",
        "ResourceNotFound",
        "ResourceNotFoundException",
    }
)
# What a message says when a resource is missing or refused (s3torchconnector's S3Exception carries
# mountpoint-s3-client's text, e.g. "Service error: The bucket does not exist").
MISSING_WORDS = (
    "bucket does not exist",
    "key does not exist",
    "object was not found",
    "NoSuchBucket",
    "NoSuchKey",
    "Access Denied",
    "AccessDenied",
    "Forbidden",
    "InvalidAccessKeyId",
)
# What a RuntimeError says when it comes from the world, not the code (NCCL, CUDA hardware, gloo).
TRANSIENT_WORDS = (
    "NCCL",
    "nccl",
    "CUDA error",
    "ECC",
    "gloo",
    "Connection reset",
    "Connection refused",
    "Broken pipe",
    "timed out",
    "Timeout",
    "SlowDown",
    "Throttl",
    "InternalError",
    "ServiceUnavailable",
    "Service Unavailable",
)


@dataclass(frozen=True)
class Failure:
    kind: str  # RECIPE, CODE, MISSING_RESOURCE or TRANSIENT
    exit_code: int
    message: str  # the failure line's message: kind, cause, where, what to change

    @property
    def deterministic(self) -> bool:
        return self.kind != TRANSIENT


def _names(exc: BaseException) -> set[str]:
    return {c.__name__ for c in type(exc).__mro__}


def _module(exc: BaseException) -> str:
    return type(exc).__module__ or ""


def _error_code(exc: BaseException) -> str | None:
    """botocore ClientError's Error.Code, read without importing botocore."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        return str(code) if code is not None else None
    return None


def _kind_of(exc: BaseException) -> str | None:
    """The class of one exception, or None when its type alone says nothing (a plain RuntimeError)."""
    names, module, text = _names(exc), _module(exc), str(exc)
    if "TrainstackError" in names:
        return RECIPE
    code = _error_code(exc)
    if code is not None:  # botocore: the service said what
        return MISSING_RESOURCE if code in MISSING_CODES else TRANSIENT
    if names & TRANSIENT_ERRORS:
        return TRANSIENT
    if names & MISSING_FILE_ERRORS:
        return MISSING_RESOURCE
    if module.startswith(("torch._dynamo", "torch._inductor")):  # torch.compile could not do it
        return CODE
    if "S3Exception" in names:
        return MISSING_RESOURCE if any(w in text for w in MISSING_WORDS) else TRANSIENT
    if names & CODE_ERRORS:
        return CODE
    if any(w in text for w in TRANSIENT_WORDS):
        return TRANSIENT
    if any(w in text for w in MISSING_WORDS):
        return MISSING_RESOURCE
    return None


def chain(exc: BaseException) -> list[BaseException]:
    """`exc` and what caused it (`raise ... from`, else the exception being handled), outermost first."""
    found: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in found and len(found) < 16:
        found.append(current)
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return found


def kind_of(exc: BaseException) -> str:
    """The class of `exc`: the first of its cause chain (outermost first) whose type says one; a missing
    resource anywhere in the chain wins (a save that failed because its bucket is gone); possibly
    transient when none says (an unknown failure is worth one more job, within the run's budget)."""
    kinds = [k for e in chain(exc) if (k := _kind_of(e)) is not None]
    if MISSING_RESOURCE in kinds:
        return MISSING_RESOURCE
    return kinds[0] if kinds else TRANSIENT


def where(exc: BaseException) -> str:
    """The innermost frame of the traceback, `file:line in function` (the file relative to the package)."""
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ else []
    if not frames:
        return ""
    frame = frames[-1]
    path = frame.filename
    for marker in ("/trainer/", "/trainstack/", "/site-packages/"):
        if marker in path:
            path = path[path.rindex(marker) + 1 :]
            break
    return f"{path}:{frame.lineno} in {frame.name}"


def cause_of(exc: BaseException) -> str:
    """`Type: first line of its text`, one line, at most CAUSE_MAX characters."""
    text = " ".join(str(exc).split())
    cause = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return cause if len(cause) <= CAUSE_MAX else cause[: CAUSE_MAX - 3] + "..."


def classify(exc: BaseException) -> Failure:
    """The failure line's exit code and message for an uncaught `exc`: `<kind>: <cause> (<where>);
    <what to change>`."""
    kind = kind_of(exc)
    if kind == RECIPE:  # the trainer's own check: its message names the file and the field
        return Failure(
            kind, getattr(exc, "exit_code", exit_codes.RECIPE_OR_ENVIRONMENT), f"{exc}; {ADVICE[kind]}"
        )
    compile_failure = any(_module(e).startswith(("torch._dynamo", "torch._inductor")) for e in chain(exc))
    advice = COMPILE_ADVICE if kind == CODE and compile_failure else ADVICE[kind]
    at = where(exc)
    label = "deterministic " + kind if kind != TRANSIENT else kind
    message = f"{label}: {cause_of(exc)}" + (f" ({at})" if at else "") + f"; {advice}"
    return Failure(kind, EXIT_CODE[kind], message)


def kind_of_reason(failure_reason: str | None) -> str | None:
    """The class a job's FailureReason names, by its failure line's exit code (None: not a trainstack
    line, or one of the trainer's other fatal ends: NaN, no EFA, out of GPU memory)."""
    code = exit_codes.exit_code_of(failure_reason)
    return next((kind for kind, c in EXIT_CODE.items() if c == code), None)
