"""The one CreateTrainingJob request check: botocore's model constraints that ParamValidator skips, and
SageMaker's documented cross-field rules, over every request the project can produce for every recipe.

The local emulator enforces none of this (../shared/README.md section 12): these tests are the gate."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from botocore.validate import ParamValidator

from trainstack.aws import request_check
from trainstack.aws.deployment import load
from trainstack.aws.request import Runtime, create_training_job_request
from trainstack.aws.request_check import (
    MAX_RUNTIME_SECONDS,
    PLACEHOLDERS,
    Finding,
    all_patterns,
    check_recipe,
    check_request,
    java_pattern,
    longest_job_name,
    requests_for,
)
from trainstack.errors import RecipeError, TrainstackError
from trainstack.recipes import hardware, naming
from trainstack.recipes.loader import base_recipe_names, resolve, team_names, team_recipe_names
from trainstack.recipes.schema import RECIPE_NAME_MAX, TEAM_NAME_MAX, Recipe, to_hyperparameters

pytestmark = pytest.mark.fast

ALL = [(n, None) for n in base_recipe_names()] + [(n, t) for t in team_names() for n in team_recipe_names(t)]
PLAN_ARN = "arn:aws:sagemaker:us-west-2:123456789012:training-plan/p6-b200-reserved-2026"
# The launch options a recipe can be deployed with; VPC mode and the capacity-retry name are in every
# check (request_check.requests_for yields both for each option).
OPTIONS = {
    "on-demand": (),
    "spot": ("compute.spot=true",),
    "spot-capped-wait": ("compute.spot=true", "compute.max_wait_hours=30", "compute.max_runtime_hours=20"),
    "training-plan": (f"compute.training_plan_arn={PLAN_ARN}",),
    "warm-pool": ("compute.keep_alive_seconds=1800",),
}


def recipe(name: str = "1b-bf16", team: str | None = None, *overrides: str) -> Recipe:
    return resolve(name, team, overrides).recipe


def request(r: Recipe | None = None, **changes: object) -> dict:
    """A concrete, valid request for `r` (default 1b-bf16), then `changes` (dotted member -> value)."""
    r = r or recipe()
    body = create_training_job_request(r, None, job_name=longest_job_name(r, None), **PLACEHOLDERS)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = body
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return body


def paths(findings: list[Finding]) -> set[str]:
    return {f.path for f in findings}


# --- the whole project ------------------------------------------------------------------------


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize(("name", "team"), ALL)
def test_every_recipe_team_and_option_gives_requests_sagemaker_accepts(name, team, option) -> None:
    r = recipe(name, team, *OPTIONS[option])
    made = dict(requests_for(r, team))
    # The supervisor's request (run-time values), and concrete ones: the longest name, with and without VPC.
    assert any("supervisor" in what and "VPC" in what for what in made)
    longest = longest_job_name(r, team)
    assert any(body.get("TrainingJobName") == longest and "VpcConfig" in body for body in made.values())
    assert any(body.get("TrainingJobName.$") for body in made.values())
    assert check_recipe(r, team) == []


def test_the_recipes_request_passes_botocores_own_validator_too() -> None:
    """The check includes ParamValidator (types, required members), run-time values included."""
    r = recipe("30b-fp8")
    for _, body in requests_for(r, None):
        assert check_request(body) == []
    launcher = next(body for what, body in requests_for(r, None) if "supervisor" in what)
    assert "TrainingJobName" not in launcher and "TrainingJobName.$" in launcher
    broken = {k: v for k, v in launcher.items() if k not in ("TrainingJobName.$", "RoleArn")}
    assert any("RoleArn" in f.message or "TrainingJobName" in f.message for f in check_request(broken))
    report = ParamValidator().validate(
        broken, request_check._input_shape("sagemaker", request_check.OPERATION)
    )
    assert report.has_errors()  # the same finding botocore makes


def test_every_pattern_of_the_request_shapes_compiles_in_python() -> None:
    patterns = dict(all_patterns())
    assert len(patterns) > 20 and "TagKey" in patterns and "TrainingJobName" in patterns
    for shape, pattern in patterns.items():
        assert java_pattern(pattern).pattern, shape


def test_java_patterns_keep_their_java_meaning() -> None:
    tag = java_pattern(dict(all_patterns())["TagKey"])  # ([\p{L}\p{Z}\p{N}_.:/=+\-@]*)
    assert tag.fullmatch("Équipe 2026: ML/Forschung") and tag.fullmatch("日本語") and tag.fullmatch("Ⅻ")
    assert not tag.fullmatch("a#b") and not tag.fullmatch("tab\there") and not tag.fullmatch("a,b")
    job = java_pattern(dict(all_patterns())["TrainingJobName"])
    assert job.fullmatch("ts-nlp-8b-fp8--0a1b2c3d-r1") and not job.fullmatch("a_b")
    assert not job.fullmatch("ends-with-")  # matched whole, as the service does, not as a prefix
    assert not java_pattern(r"\d+K").fullmatch("١٢K")  # Java's \d is ASCII-only
    assert java_pattern(r"arn:[\p{Alnum}\-]+:x").fullmatch("arn:aws-cn:x")
    assert not java_pattern(r"[\p{Alnum}]").fullmatch("é")  # POSIX classes are ASCII in Java
    with pytest.raises(ValueError):
        java_pattern(r"[a-z&&[^q]]")  # an intersection has no Python equivalent here: refused, not guessed


# --- the limits the issue names -----------------------------------------------------------------


def test_an_over_long_job_name_with_an_underscore_is_refused() -> None:
    name = "ts_" + "x" * 81  # 84 characters
    found = check_request(request(TrainingJobName=name))
    assert {(f.path, "84 characters" in f.message or "pattern" in f.message) for f in found} == {
        ("TrainingJobName", True)
    }
    assert len(found) == 2  # too long, and `_` is not in the pattern


def test_an_unknown_instance_type_is_refused() -> None:
    (finding,) = check_request(request(**{"ResourceConfig.InstanceType": "ml.p9.96xlarge"}))
    assert finding.path == "ResourceConfig.InstanceType" and "not one of" in finding.message


def test_a_runtime_beyond_28_days_is_refused() -> None:
    assert MAX_RUNTIME_SECONDS == 2_419_200
    (finding,) = check_request(request(**{"StoppingCondition.MaxRuntimeInSeconds": 99_999_999}))
    assert finding.path == "StoppingCondition.MaxRuntimeInSeconds" and "28 days" in finding.message
    assert check_request(request(**{"StoppingCondition.MaxRuntimeInSeconds": MAX_RUNTIME_SECONDS})) == []


def test_a_volume_key_on_p6_b200_is_refused_and_never_sent() -> None:
    r = recipe("30b-fp8")
    assert r.compute.instance_type == "ml.p6-b200.48xlarge" and r.instance.instance_store_gb == 8 * 3840
    sent = request(r)
    assert "VolumeKmsKeyId" not in sent["ResourceConfig"] and "VolumeSizeInGB" not in sent["ResourceConfig"]
    assert sent["OutputDataConfig"]["KmsKeyId"] == PLACEHOLDERS["kms_key_arn"]  # the output stays encrypted
    (finding,) = check_request(request(r, **{"ResourceConfig.VolumeKmsKeyId": PLACEHOLDERS["kms_key_arn"]}))
    assert finding.path == "ResourceConfig.VolumeKmsKeyId" and "hardware module" in finding.message
    (finding,) = check_request(request(r, **{"ResourceConfig.VolumeSizeInGB": 40_000}))
    assert finding.path == "ResourceConfig.VolumeSizeInGB" and "30,720 GB of local NVMe" in finding.message


def test_an_ebs_only_type_gets_its_volume_sized_and_encrypted(monkeypatch) -> None:
    ebs_only = dataclasses.replace(hardware.INSTANCES["ml.p5.48xlarge"], instance_store_disks=0)
    monkeypatch.setitem(hardware.INSTANCES, "ml.p5.48xlarge", ebs_only)
    r = recipe("7b-bf16", None, "compute.instance_type=ml.p5.48xlarge", "compute.volume_size_gb=900")
    sent = request(r)
    assert sent["ResourceConfig"]["VolumeSizeInGB"] == 900
    assert sent["ResourceConfig"]["VolumeKmsKeyId"] == PLACEHOLDERS["kms_key_arn"]
    assert check_request(sent) == []


def test_a_recipe_volume_above_the_local_storage_is_refused(monkeypatch) -> None:
    small = dataclasses.replace(hardware.INSTANCES["ml.p5.48xlarge"], instance_store_disk_gb=100)
    monkeypatch.setitem(hardware.INSTANCES, "ml.p5.48xlarge", small)
    assert hardware.volume_size_problem(small, 800) is None
    assert "exceeds the 800 GB of local NVMe storage" in hardware.volume_size_problem(small, 900)
    with pytest.raises(RecipeError, match=r"compute\.volume_size_gb: 900 GB exceeds the 800 GB"):
        recipe("7b-bf16", None, "compute.instance_type=ml.p5.48xlarge", "compute.volume_size_gb=900")


# --- SageMaker's cross-field rules --------------------------------------------------------------


def test_warm_pools_are_refused_with_spot_literal_or_at_run_time() -> None:
    spot = {"EnableManagedSpotTraining": True, "StoppingCondition.MaxWaitTimeInSeconds": 7200}
    spot["StoppingCondition.MaxRuntimeInSeconds"] = 3600
    (finding,) = check_request(request(**spot, **{"ResourceConfig.KeepAlivePeriodInSeconds": 600}))
    assert finding.path == "ResourceConfig.KeepAlivePeriodInSeconds" and "spot" in finding.message
    runtime = request(**spot)
    runtime["ResourceConfig"].pop("KeepAlivePeriodInSeconds")
    runtime["ResourceConfig"]["KeepAlivePeriodInSeconds.$"] = "$.KeepAlivePeriodInSeconds"
    assert paths(check_request(runtime)) == {"ResourceConfig.KeepAlivePeriodInSeconds"}
    assert check_request(request(**spot, **{"ResourceConfig.KeepAlivePeriodInSeconds": 0})) == []


def test_a_spot_recipe_never_asks_for_a_warm_pool_and_one_that_wants_both_is_told() -> None:
    r = recipe("1b-bf16", None, "compute.spot=true")
    for _, body in requests_for(r, None):
        assert not any(k.startswith("KeepAlivePeriodInSeconds") for k in body["ResourceConfig"])
    (finding,) = check_recipe(
        recipe("1b-bf16", None, "compute.spot=true", "compute.keep_alive_seconds=600"), None
    )
    assert finding.field == "compute.keep_alive_seconds" and "spot" in finding.message


def test_max_wait_only_with_spot_and_never_below_max_runtime() -> None:
    stopping = {"StoppingCondition": {"MaxRuntimeInSeconds": 3600, "MaxWaitTimeInSeconds": 7200}}
    (finding,) = check_request(request(**stopping))
    assert finding.path == "StoppingCondition.MaxWaitTimeInSeconds" and "spot" in finding.message
    short_wait = {
        "EnableManagedSpotTraining": True,
        "StoppingCondition.MaxRuntimeInSeconds": 7200,
        "StoppingCondition.MaxWaitTimeInSeconds": 3600,
        "ResourceConfig.KeepAlivePeriodInSeconds": 0,
    }
    (finding,) = check_request(request(**short_wait))
    assert (
        finding.path == "StoppingCondition.MaxWaitTimeInSeconds"
        and "MaxWait >= MaxRuntime" in finding.message
    )


def test_tags_at_most_50_with_aws_characters_and_lengths_and_no_aws_prefix() -> None:
    base = request()["Tags"]
    many = base + [{"Key": f"k{i}", "Value": "v"} for i in range(51 - len(base))]
    assert {(f.path, "more than" in f.message) for f in check_request(request(Tags=many))} == {("Tags", True)}
    assert check_request(request(Tags=many[:50])) == []
    for tag, path in (
        ({"Key": "aws:owner", "Value": "x"}, "Tags[4].Key"),
        ({"Key": "AWS:Owner", "Value": "x"}, "Tags[4].Key"),
        ({"Key": "k" * 129, "Value": "x"}, "Tags[4].Key"),
        ({"Key": "owner", "Value": "v" * 257}, "Tags[4].Value"),
        ({"Key": "owner", "Value": "a#b"}, "Tags[4].Value"),
        ({"Key": "team", "Value": "again"}, "Tags[4].Key"),  # keys are unique per resource
    ):
        assert paths(check_request(request(Tags=base + [tag]))) == {path}, tag


def test_at_most_100_hyperparameters_of_at_most_2500_characters() -> None:
    hyper = to_hyperparameters(recipe())
    assert 50 < len(hyper) <= 100  # the recipe's own encoding leaves room; the limit is close enough to pin
    more = {**hyper, **{f"extra.k{i}": "1" for i in range(101 - len(hyper))}}
    assert paths(check_request(request(HyperParameters=more))) == {"HyperParameters"}
    (finding,) = check_request(request(HyperParameters={**hyper, "description": '"' + "x" * 2499 + '"'}))
    assert finding.path == "HyperParameters[description]" and "2,501 characters" in finding.message


def test_at_most_40_metric_definitions() -> None:
    metrics = request()["AlgorithmSpecification"]["MetricDefinitions"]
    assert len(metrics) <= 40
    too_many = [{"Name": f"m{i}", "Regex": "x=(\\S+)"} for i in range(41)]
    found = check_request(request(**{"AlgorithmSpecification.MetricDefinitions": too_many}))
    assert paths(found) == {"AlgorithmSpecification.MetricDefinitions"}


def test_environment_at_most_100_variables_with_valid_names_and_short_values() -> None:
    env = request()["Environment"]
    assert paths(check_request(request(Environment={f"V{i}": "1" for i in range(101)}))) == {"Environment"}
    assert paths(check_request(request(Environment={**env, "1BAD": "x"}))) == {"Environment[1BAD] key"}
    assert paths(check_request(request(Environment={**env, "LONG": "x" * 513}))) == {"Environment[LONG]"}


def test_a_training_plan_arn_must_be_one() -> None:
    assert check_request(request(**{"ResourceConfig.TrainingPlanArn": PLAN_ARN})) == []
    for bad in ("p6-b200-reserved", "arn:aws:sagemaker:us-west-2:123456789012:training-job/not-a-plan-xx"):
        found = check_request(request(**{"ResourceConfig.TrainingPlanArn": bad}))
        assert paths(found) == {"ResourceConfig.TrainingPlanArn"}, bad


# --- names, and what the user is told ----------------------------------------------------------


def test_the_longest_name_the_supervisor_makes_fits_and_the_check_follows_naming(monkeypatch) -> None:
    longest = recipe().model_copy(update={"name": "r" * RECIPE_NAME_MAX})
    team = "t" * TEAM_NAME_MAX
    name = longest_job_name(longest, team)
    # `<prefix><run id>-<job index>` with the longest run id and the 99th job: exactly SageMaker's 63.
    assert len(name) == len(naming.job_name_prefix(longest, team)) + naming.RUN_ID_MAX + naming.JOB_SUFFIX_MAX
    assert name.endswith(f"-{naming.job_suffix(naming.JOB_INDEX_MAX)}") and len(name) == naming.JOB_NAME_MAX
    assert check_recipe(longest, team) == []
    # Were the supervisor to name jobs past 63 characters, the check would refuse the recipe before deploy.
    monkeypatch.setattr("trainstack.aws.request_check.longest_job_name", lambda r, t: name + "-x")
    found = check_recipe(longest, team)
    assert {f.path for f in found} == {"TrainingJobName"} and {f.field for f in found} == {"name"}


def test_findings_name_the_recipe_field_that_causes_them() -> None:
    cases = {
        ("tags.extra={owner: 'a#b'}",): "tags.extra.owner",
        ("tags.cost_center=a#b",): "tags.cost_center",
        (f"description={'d' * 2600}",): "description",
        ("compute.training_plan_arn=plan-p6",): "compute.training_plan_arn",
        ("image.uri=" + "x" * 300,): "image.uri",
    }
    for overrides, field in cases.items():
        found = check_recipe(recipe("1b-bf16", None, *overrides), None)
        assert {f.field for f in found} == {field}, (overrides, found)


def test_launcher_runtime_values_are_not_mistaken_for_literals() -> None:
    r = recipe()
    body = create_training_job_request(
        r,
        None,
        job_name=Runtime("$.Attempt.JobName"),
        hyperparameters=Runtime("States.JsonMerge($.a, $.b, false)"),
        keep_alive_seconds=Runtime("$.KeepAlivePeriodInSeconds"),
        **PLACEHOLDERS,
    )
    assert check_request(body) == []
    body["NotAMember.$"] = "$.x"
    assert any("NotAMember" in f.message for f in check_request(body))


def test_reserved_tags_cannot_be_replaced_by_extra_tags() -> None:
    for key in ("project", "team", "recipe", "cost-center"):
        with pytest.raises(RecipeError, match=rf"tags\.extra: '{key}' is one of trainstack's own tags"):
            recipe("1b-bf16", None, f"tags.extra={{{key}: mine}}")
    assert recipe("1b-bf16", None, "tags.extra={workload: mine}").tags.extra == {"workload": "mine"}


SPOT_WARM = """\
name: {name}
model: {{layers: 16, hidden: 2048, heads: 32, kv_heads: 8, ffn: 8192, vocab: 128256, tied_embeddings: true}}
training: {{seq_len: 4096, micro_batch: 4, global_batch: 256, steps: 200}}
precision: {{dtype: bf16}}
activation_checkpointing: {{mode: none}}
parallelism: {{shard_group: 8}}
compute: {{instance_type: ml.p6-b200.48xlarge, spot: true, keep_alive_seconds: 900}}
"""


@pytest.fixture
def bad_tree(tmp_path: Path) -> Path:
    root = tmp_path / "recipes"
    root.mkdir()
    (root / "spotwarm.yaml").write_text(SPOT_WARM.format(name="spotwarm"))
    return root


def test_validate_plan_and_synth_refuse_the_recipe_in_one_line(bad_tree: Path, capsys) -> None:
    from typer.testing import CliRunner

    from trainstack.cli.main import app

    expected = "spotwarm.yaml: compute.keep_alive_seconds: 900: SageMaker warm pools cannot be used"
    runner = CliRunner()
    for args in (
        ["validate", "--recipes-dir", str(bad_tree)],
        ["plan", "spotwarm", "--recipes-dir", str(bad_tree)],
    ):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, result.output
        lines = [line for line in result.output.splitlines() if expected in line]
        assert len(lines) == 1 and "Traceback" not in result.output, result.output
    with pytest.raises(TrainstackError, match=expected) as error:
        load(
            {"recipe": "spotwarm", "image_uri": "123456789012.dkr.ecr.us-west-2.amazonaws.com/x:1"},
            {},
            recipes_dir=str(bad_tree),
        )
    assert error.value.exit_code == 2 and "\n" not in str(error.value)
