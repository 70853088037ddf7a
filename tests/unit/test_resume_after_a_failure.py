"""What a fix needs reaches the run (issue 40, item 3): `resume --set image.uri=` is the image of the
next job, the other image keys are refused in one line, and a run whose last job failed on its recorded
recipe or in its image's code is refused by `resume` when nothing would change (it would fail the same
way), with "launch a new run" (or the --set that fixes it) and why."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

import pytest
from test_run_request import RUN, recorded
from typer.testing import CliRunner

from trainstack.aws import run_request
from trainstack.aws.registry import JobRecord, Run, resume_refusal
from trainstack.cli.main import app
from trainstack.protocol import exit_codes, failures

pytestmark = pytest.mark.fast

FIXED = "123456789012.dkr.ecr.us-east-1.amazonaws.com/repo:fixed"


def test_resume_set_image_uri_is_the_image_of_the_next_job() -> None:
    """Before: the change was printed and recorded in the hyperparameters, and the job kept the recorded
    TrainingImage, so a trainer fix could never reach a running run."""
    before_request = recorded()
    before = run_request.recipe_of(before_request)
    after = run_request.apply_sets(before, [f"image.uri={FIXED}"])
    changed = run_request.changed_request(before_request, before, after, None)
    assert changed["AlgorithmSpecification"]["TrainingImage"] == FIXED
    assert changed["HyperParameters"]["image.uri"] == f'"{FIXED}"'  # hyperparameters are JSON values
    untouched = {k: v for k, v in changed.items() if k not in ("AlgorithmSpecification", "HyperParameters")}
    assert untouched == {k: v for k, v in before_request.items() if k in untouched}
    assert set(untouched) == set(before_request) - {"AlgorithmSpecification", "HyperParameters"}
    spec = dict(
        changed["AlgorithmSpecification"],
        TrainingImage=before_request["AlgorithmSpecification"]["TrainingImage"],
    )
    assert spec == before_request["AlgorithmSpecification"]
    # ... and a later change of another key keeps the fixed image (the recorded one now).
    again = run_request.apply_sets(after, ["training.lr=0.0001"])
    assert (
        run_request.changed_request(changed, after, again, None)["AlgorithmSpecification"]
        == (changed["AlgorithmSpecification"])
    )


@pytest.mark.parametrize(
    ("assignment", "words"),
    [
        (
            "image.framework_version=2.8",
            "an image is built when a recipe is deployed, never for a running run",
        ),
        ("image.uri=", "give the image the next job runs"),
    ],
)
def test_an_image_change_no_job_would_see_is_refused_in_one_line(monkeypatch, assignment, words) -> None:
    """Refused before any AWS call (no endpoint listens: a call would fail otherwise)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://localhost:1")  # nothing listens: any call would fail
    result = CliRunner().invoke(app, ["resume", RUN, "--set", assignment])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and words in lines[0] and f"--set {assignment}" in lines[0], lines
    assert "Traceback" not in result.output


def run(why: str, rule: str, state: str = "failed") -> Run:
    now = datetime.now(UTC)
    return Run(
        run=RUN,
        run_id="main",
        recipe="1b-bf16",
        team="platform",
        state=state,
        current_job=f"{RUN}-2",
        job_index=2,
        jobs=(
            JobRecord(f"{RUN}-1", 1, "Stopped", "MaxRuntimeExceeded", "MaxRuntime"),
            JobRecord(f"{RUN}-2", 2, "Failed", "Failed", rule),
        ),
        checkpoint_uri="s3://bucket/checkpoints/platform/1b-bf16/main/",
        steps=100,
        tokens_per_step=1,
        usd_per_hour=1.0,
        overrides={},
        keep_alive=0,
        stop_requested=False,
        why=why,
        next_step="a person must look at it",
        recipe_hash="h",
        max_jobs=20,
        creator="",
        created=now,
        updated=now,
        request=recorded(),
    )


FATAL_WHY = "the trainer reported a failure the next job would repeat: AlgorithmError: "


def fatal(code: int, message: str) -> Run:
    return run(FATAL_WHY + exit_codes.failure_line(code, message), "Fatal")


def test_a_run_that_failed_on_its_recorded_recipe_is_refused_as_it_is_with_launch_a_new_run() -> None:
    """Issue 40 item 4: a recipe mistake found on the instance, the recipe fixed and redeployed, then
    `resume`: jobs 2 and 3 failed the same way (the run trains its recorded recipe)."""
    failed = fatal(2, "init_from config.json: tie_word_embeddings false, recipe model.tied_embeddings true")
    refusal = resume_refusal(failed, changes=False)
    assert refusal is not None and refusal.startswith(f"run {RUN} cannot be resumed as it is: its last job")
    assert "Launch a new run with the fixed recipe" in refusal and "tied_embeddings" in refusal
    assert "\n" not in refusal
    assert resume_refusal(failed, changes=True) is None  # a --set that may be the fix goes ahead
    out_of_memory = resume_refusal(fatal(exit_codes.OUT_OF_MEMORY, "out of GPU memory: ..."), changes=False)
    assert out_of_memory is not None and "launch a new run" in out_of_memory.lower()


def test_a_run_that_failed_in_its_images_code_is_refused_until_a_fixed_image_is_given() -> None:
    try:
        raise TypeError("'int' object is not callable")
    except TypeError as exc:
        found = failures.classify(exc)
    failed = fatal(found.exit_code, found.message)
    refusal = resume_refusal(failed, changes=False)
    assert (
        refusal is not None and "--set image.uri=<fixed image>" in refusal and "launch a new run" in refusal
    )
    assert "TypeError" in refusal


@pytest.mark.parametrize(
    "failed",
    [
        fatal(exit_codes.MISSING_RESOURCE, "missing resource: NoSuchBucket"),  # created outside, then resume
        fatal(exit_codes.NON_FINITE, "loss became nan at step 1200"),  # resume --from-step with another lr
        fatal(exit_codes.NETWORK, "no EFA"),  # the deployment's network
        run("3 jobs of the run in a row ended without a checkpoint past step 10", "CrashLoop"),
        run("it was stopped by trainstack stop", "StopRequested", state="stopped"),
    ],
    ids=["missing-resource", "nan", "no-efa", "crash-loop", "stopped"],
)
def test_other_ends_resume_as_they_are(failed: Run) -> None:
    assert resume_refusal(failed, changes=False) is None


def test_the_refusal_reads_the_newest_job() -> None:
    failed = fatal(2, "bad recipe")
    older_fatal = replace(failed, jobs=tuple(reversed(failed.jobs)))  # registry order does not matter
    assert resume_refusal(older_fatal, changes=False) == resume_refusal(failed, changes=False)
