"""Every failure of a job's process says why in one line and whether the next job would repeat it
(trainstack.protocol.failures, trainer.runtime.failure): the classes, the line within SageMaker's limit,
and the entry points that write it (the trainer, its node entrypoint, the export and the processing job)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainstack.aws.supervisor import EndedJob, Outcome, RunRecord, next_action
from trainstack.protocol import exit_codes, failures

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]
TRAINING_IMAGE = ROOT / "training_image"


def test_failure_lines_fit_the_reason_sagemaker_keeps() -> None:
    """DescribeTrainingJob's FailureReason and DescribeProcessingJob's ExitMessage hold at most 1,024
    characters (SageMaker API reference, "Length Constraints: Maximum length of 1024"; the same in
    botocore's service model, read here). The line is cut there with its class and cause first."""
    import botocore.session

    model = botocore.session.get_session().get_service_model("sagemaker")
    training = model.operation_model("DescribeTrainingJob").output_shape.members["FailureReason"]
    processing = model.operation_model("DescribeProcessingJob").output_shape.members["ExitMessage"]
    assert exit_codes.FAILURE_REASON_MAX == training.metadata["max"] == processing.metadata["max"] == 1024
    try:
        raise TypeError("x" * 5000)
    except TypeError as exc:
        found = failures.classify(exc)
    line = exit_codes.failure_line(found.exit_code, found.message)
    assert len(line) <= exit_codes.FAILURE_REASON_MAX and "\n" not in line
    assert line.startswith("trainstack-fatal exit=6: deterministic code: TypeError: xxx")
    assert "resume RUN --set image.uri=" in line  # what to change survives the cut of a long cause


def _raised(exc: BaseException, cause: BaseException | None = None) -> BaseException:
    try:
        try:
            if cause is not None:
                raise cause
        except BaseException as inner:
            raise exc from inner
        raise exc
    except BaseException as caught:
        return caught


def _client_error(code: str) -> BaseException:
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": "m"}}, "PutObject")


class CheckpointError(Exception):  # as trainer.checkpoint.state's: a wrapper that says nothing itself
    pass


@pytest.mark.parametrize(
    ("make", "kind", "code"),
    [
        (lambda: TypeError("unsupported operand"), failures.CODE, exit_codes.CODE),
        (lambda: AttributeError("'NoneType' object has no attribute 'step'"), failures.CODE, 6),
        (lambda: ModuleNotFoundError("No module named 'transformer_engine'"), failures.CODE, 6),
        (lambda: FileNotFoundError("/opt/ml/input/data/train/shard-0.bin"), failures.MISSING_RESOURCE, 7),
        (lambda: _client_error("NoSuchBucket"), failures.MISSING_RESOURCE, exit_codes.MISSING_RESOURCE),
        (lambda: _client_error("AccessDenied"), failures.MISSING_RESOURCE, 7),
        (lambda: _client_error("SlowDown"), failures.TRANSIENT, exit_codes.TRANSIENT),
        (lambda: _client_error("InternalError"), failures.TRANSIENT, 1),
        (lambda: ConnectionResetError("peer reset"), failures.TRANSIENT, 1),
        (lambda: TimeoutError("store"), failures.TRANSIENT, 1),
        (lambda: RuntimeError("NCCL error: unhandled system error"), failures.TRANSIENT, 1),
        (lambda: RuntimeError("something nobody recognises"), failures.TRANSIENT, 1),
        (  # a save that failed because its bucket is gone: the cause decides
            lambda: _raised(CheckpointError("save of step 20 failed"), _client_error("NoSuchBucket")),
            failures.MISSING_RESOURCE,
            7,
        ),
        (  # a wrapper around a bug is the bug
            lambda: _raised(RuntimeError("step failed"), KeyError("layers.3")),
            failures.CODE,
            6,
        ),
    ],
    ids=lambda v: v if isinstance(v, (str, int)) else "",
)
def test_every_exception_gets_a_class_and_the_exit_code_that_says_it(make, kind: str, code: int) -> None:
    exc = make()
    found = failures.classify(exc)
    assert (found.kind, found.exit_code) == (kind, code)
    assert (code in exit_codes.FATAL) is found.deterministic  # the supervisor's Fatal rule reads the marker
    assert type(exc).__name__ in found.message


@pytest.mark.slow  # imports torch (and dynamo): 5-50 s on 2 busy cores
def test_a_torch_compile_failure_is_deterministic_and_says_how_to_turn_compile_off() -> None:
    """Issue 40 item 5's crash (`torch._dynamo.exc.Unsupported`): the next job would fail the same way;
    `training.compile` may change mid-run, so the line says so."""
    from torch._dynamo.exc import Unsupported

    found = failures.classify(_raised(Unsupported("call_function time.perf_counter")))
    assert found.kind == failures.CODE and "--set training.compile=false" in found.message


def test_the_trainstack_error_of_a_recipe_keeps_its_exit_code_and_names_the_field() -> None:
    from trainstack.errors import RecipeError

    found = failures.classify(_raised(RecipeError("hyperparameters.json", "model.dim", "must be even")))
    assert (found.kind, found.exit_code) == (failures.RECIPE, 2)
    assert found.message.startswith("hyperparameters.json: model.dim: must be even")


@pytest.mark.parametrize(
    ("exc", "rule"),
    [
        (TypeError("bug"), "Fatal"),
        (FileNotFoundError("the data"), "Fatal"),
        (ConnectionResetError("peer"), "Crashed"),
    ],
    ids=["code", "missing-resource", "transient"],
)
def test_the_supervisor_acts_on_the_class_in_the_reason(exc: BaseException, rule: str) -> None:
    found = failures.classify(_raised(exc))
    reason = "AlgorithmError: " + exit_codes.failure_line(found.exit_code, found.message)
    run = RunRecord("ts-p-r--x", "running", "ts-p-r--x-1", 1, steps=100)
    action = next_action(run, EndedJob(run.current_job, "Failed", "Failed", reason))
    assert action.rule == rule and type(exc).__name__ in action.why
    assert (action.outcome is Outcome.FAILED) is (rule == "Fatal")
    assert failures.kind_of_reason(reason) == found.kind


def _python(module: str, *args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        env={**os.environ, "PYTHONPATH": f"{TRAINING_IMAGE}{os.pathsep}{ROOT}", **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow  # imports torch (and dynamo): 5-50 s on 2 busy cores
def test_the_export_jobs_failure_reaches_its_failure_file(tmp_path: Path) -> None:
    """Before: the export printed its error and exited 2; the job's reason was "exit code 2 (no
    /opt/ml/output/failure)"."""
    failure = tmp_path / "failure"
    done = _python(
        "trainer.export",
        *("--checkpoint", str(tmp_path / "no-checkpoints"), "--out", str(tmp_path / "out")),
        *("--recipe", str(ROOT / "tests/trainer/fixtures/tiny.yaml")),
        env={"TRAINSTACK_FAILURE_FILE": str(failure)},
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    line = failure.read_text().strip()
    assert line.startswith("trainstack-fatal exit=2: ") and str(tmp_path / "no-checkpoints") in line
    assert done.stderr.strip().splitlines()[-1] == "error: " + line.removeprefix("trainstack-fatal exit=2: ")


@pytest.mark.slow  # imports torch (and dynamo): 5-50 s on 2 busy cores
def test_the_processing_jobs_failure_reaches_its_exit_message(tmp_path: Path) -> None:
    message = tmp_path / "message"
    done = _python(
        "trainer.prepare",
        *(str(tmp_path / "no-such-corpus"), "--tokenizer", "bytes", "--out", str(tmp_path / "out")),
        env={"TRAINSTACK_FAILURE_FILE": str(message)},
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    assert (
        message.read_text().startswith("trainstack-fatal exit=2: ")
        and "no-such-corpus" in message.read_text()
    )


def test_an_uncaught_error_of_an_entry_point_is_classified_in_its_failure_file(tmp_path: Path) -> None:
    """What escapes a module's main (here the node entrypoint given a resource config that is not JSON,
    then one whose trainer processes die without a word) is a line too."""
    failure = tmp_path / "failure"
    config = tmp_path / "resourceconfig.json"
    config.write_text("{not json")
    done = _python(
        "trainer.entrypoint",
        *("--resource-config", str(config), "--nproc-per-node", "1"),
        env={"TRAINSTACK_FAILURE_FILE": str(failure)},
        cwd=tmp_path,
    )
    assert done.returncode == 2 and failure.read_text().startswith("trainstack-fatal exit=2: ")
    assert "not valid JSON" in failure.read_text()

    sys.path.insert(0, str(TRAINING_IMAGE))
    try:
        from trainer import entrypoint
    finally:
        sys.path.remove(str(TRAINING_IMAGE))
    failure.unlink()
    os.environ["TRAINSTACK_FAILURE_FILE"] = str(failure)
    try:
        entrypoint.explain_silent_end(-9)
        line = failure.read_text()
        assert line.startswith("trainstack exit=1: possibly transient: ") and "killed by signal 9" in line
        failure.write_text("trainstack-fatal exit=6: deterministic code: TypeError: x\n")
        entrypoint.explain_silent_end(1)  # a rank's own line is never replaced by the silent one
        assert failure.read_text().startswith("trainstack-fatal exit=6")
    finally:
        del os.environ["TRAINSTACK_FAILURE_FILE"]
